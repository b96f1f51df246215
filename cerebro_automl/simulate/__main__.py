from .virtual_time import main

main()
