from vitreg.cli.main import main

main()
