from seamlessflow.cli import main

main()
