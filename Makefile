# Both targets install what they need first (tools/dev.py env is idempotent and quick
# when nothing changed). Only Python 3.11 and this repo are needed.
.PHONY: demo test env lint docs lock

demo:
	python3 tools/dev.py demo

test:
	python3 tools/dev.py test

env:
	python3 tools/dev.py env

lint:
	python3 tools/dev.py env && .venv/bin/ruff check . && .venv/bin/ruff format --check .

docs:
	python3 tools/dev.py docs

lock:
	python3 tools/dev.py lock
