"""`python -m app` starts the PagedDesk window."""
import sys

from app.main import main

sys.exit(main())
