from vitreg.cli import main

main()
