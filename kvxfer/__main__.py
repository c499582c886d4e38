from kvxfer.cli import main

raise SystemExit(main())
