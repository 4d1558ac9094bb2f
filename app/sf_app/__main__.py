from sf_app.cli import main

main()
