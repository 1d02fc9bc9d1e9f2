"""`python -m server`: an OpenAI-compatible HTTP server over pyengine's AsyncLLM (server/cli.py)."""
import sys

from server.cli import main

sys.exit(main())
