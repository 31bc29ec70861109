from genfast.cli import main

raise SystemExit(main())
