from weft.core.commands.main import main

raise SystemExit(main())
