from engine.bench import main

main()
