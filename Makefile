# The two commands a new user needs: `make run` and `make test` (see README.md).
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell sha1sum requirements.txt | cut -c1-12)
PORT   ?= 8000

# What the suite runs against unless set: the PostgreSQL and Redis that .ci/services.sh starts.
TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/test
TEST_BROKER_URL   ?= redis://127.0.0.1:6379/0
TEST_REDIS_URL    ?= redis://127.0.0.1:6379/1
# Workers (pytest-xdist, a test file per worker; 0 runs in one process). Each worker gets its own
# test database and Redis databases (tests/workers.py).
TEST_WORKERS      ?= 3

.PHONY: run test venv clean

venv: $(STAMP)

$(STAMP): requirements.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || { \
	  echo "error: '$(PYTHON) -m venv' failed. On Debian: apt-get install python3-venv" >&2; exit 1; }
	@bash .ci/build-deps.sh $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	@rm -f $(VENV)/.installed-*
	@touch $@

run: venv
	@echo "make run: migrating the database and seeding the demo"
	@DEBUG=$${DEBUG:-1} $(PY) manage.py migrate --noinput -v 0
	@DEBUG=$${DEBUG:-1} $(PY) manage.py seed_demo
	@DEBUG=$${DEBUG:-1} $(PY) manage.py runstack --port $(PORT)

# Installs (as root, through apt-get) and starts what the suite drives, then runs it all.
test: venv
	bash .ci/services.sh
	DATABASE_URL=$${DATABASE_URL:-$(TEST_DATABASE_URL)} \
	CELERY_BROKER_URL=$${CELERY_BROKER_URL:-$(TEST_BROKER_URL)} \
	REDIS_URL=$${REDIS_URL:-$(TEST_REDIS_URL)} \
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) var
