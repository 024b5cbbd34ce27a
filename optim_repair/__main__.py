from optim_repair.cli import main

main()
