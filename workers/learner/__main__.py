from workers.learner.process import main

raise SystemExit(main())
