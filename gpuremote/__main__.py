from gpuremote.cli import main

raise SystemExit(main())
