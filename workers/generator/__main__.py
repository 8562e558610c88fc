from workers.generator.process import main

raise SystemExit(main())
