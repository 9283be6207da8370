from weft.core.cli import main

raise SystemExit(main())
