from gossip.cli import main

main()
