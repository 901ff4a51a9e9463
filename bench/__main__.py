from bench.modes import main

raise SystemExit(main())
