from specstream.cli import main

raise SystemExit(main())
