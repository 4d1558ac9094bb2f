from sf_trainer.launch import main

main()
