# The two commands a new user needs: `make run` and `make test` (see README.md).
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell sha1sum requirements.txt | cut -c1-12)
PORT   ?= 8000

# PostgreSQL for the tests when one answers locally and DATABASE_URL is not set (CI sets it).
LOCAL_PG := postgres://postgres@127.0.0.1:5432/test

.PHONY: run test venv clean

venv: $(STAMP)

$(STAMP): requirements.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || { \
	  echo "error: '$(PYTHON) -m venv' failed. On Debian: apt-get install python3-venv" >&2; exit 1; }
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	@rm -f $(VENV)/.installed-*
	@touch $@

run: venv
	DEBUG=$${DEBUG:-1} $(PY) manage.py migrate --noinput
	DEBUG=$${DEBUG:-1} $(PY) manage.py seed_demo
	DEBUG=$${DEBUG:-1} $(PY) manage.py runstack --port $(PORT)

test: venv
	@if [ -z "$$DATABASE_URL" ] && command -v pg_isready >/dev/null && pg_isready -q -h 127.0.0.1 -p 5432; then \
	  echo "make test: using local PostgreSQL ($(LOCAL_PG))"; export DATABASE_URL=$(LOCAL_PG); fi; \
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) var
