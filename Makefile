# `make demo` and `make test` do all set-up on a fresh machine: they create .venv when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: demo test test-slow test-isa test-vision test-vision-slow docs bench bench-overhead bench-zoo \
	bench-eco bench-optimum-venv lint clean durations

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: a CPU wheel; nothing after this may pull another torch.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# torchvision + timm live in their own venv (pyproject's [vision] extra): in .venv, transformers
# would import torchvision, whose CUDA-built ops do not load next to the CPU torch
VVENV := .venv-vision
VPY := $(VVENV)/bin/python
VSTAMP := $(VVENV)/.installed

$(VSTAMP): pyproject.toml
	test -x $(VPY) || $(PYTHON) -m venv $(VVENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[vision]'
	touch $(VSTAMP)

demo: $(STAMP)
	@mkdir -p build/demo
	$(PY) examples/plain_torch_onnx.py
	$(VENV)/bin/onnxmedic export examples/gaussian_copula.py:GaussianCopulaHead \
		--input 4x16:float32 -o build/demo/gaussian_copula.onnx --report build/demo/report.html

# the docs site (mkdocs.yml): --strict turns a broken link or a missing nav page into a failure
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict -q

# VISION=0 leaves out the vision tests (and .venv-vision): about 1 minute to create the venv from
# the local wheels, and a minute of tests on 2 cores
VISION ?= 1

test: $(STAMP) docs $(if $(filter 1,$(VISION)),$(VSTAMP))
	$(PY) -m pytest -n auto --dist worksteal -m "not slow" $(PYTEST_ARGS)
ifeq ($(VISION),1)
	$(VPY) -m pytest -n auto --dist worksteal -m "not slow" tests/vision $(PYTEST_ARGS)
endif

# the suite as `make test` runs it, with each test's wall and CPU seconds logged to
# build/durations.tsv (tests/durations.py) and the costliest tests and files listed: where a cut
# of the suite's 20-minute budget is chosen. CPU seconds hold on a shared machine, wall seconds not
durations: $(STAMP)
	ONNXMEDIC_DURATIONS=build/durations.tsv $(PY) -m pytest -n auto --dist worksteal \
		-m "not slow" -p tests.durations $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -n auto --dist worksteal -m slow $(PYTEST_ARGS)

# the ISA lane: the tests that run integer kernels, with the sandbox's ONNX Runtime under QEMU's
# Haswell (AVX2, no VNNI: apt-get install qemu-user). `make test` runs the minimal QEMU checks;
# this runs the whole files (about 20 minutes on 2 cores)
QEMU_HASWELL := qemu-x86_64 -cpu Haswell-noTSX,-pcid,-x2apic,-tsc-deadline,-invpcid
test-isa: $(STAMP)
	ONNXMEDIC_SANDBOX_WRAPPER="$(QEMU_HASWELL)" $(PY) -m pytest -n auto --dist worksteal \
		-m "not slow" tests/test_quantized.py tests/optimize/test_int8_isa.py \
		tests/optimize/test_int8_search.py tests/optimize/test_static_int8.py \
		tests/optimize/test_int8_weight_only.py tests/optimize/test_calibration.py $(PYTEST_ARGS)

# the vision tests (tests/vision: torchvision ops, detection, timm) in .venv-vision
test-vision: $(VSTAMP)
	$(VPY) -m pytest -n auto --dist worksteal -m "not slow" tests/vision tests/ops/test_vision.py $(PYTEST_ARGS)

test-vision-slow: $(VSTAMP)
	$(VPY) -m pytest -n auto --dist worksteal -m slow tests/vision $(PYTEST_ARGS)

bench-overhead: $(STAMP)
	$(PY) bench/peers/overhead.py

# the whole Hugging Face zoo: its slow test, then the torch.onnx-vs-onnxmedic table
bench-zoo: $(STAMP)
	$(PY) -m pip install -q -e '.[hf]'
	$(PY) -m pytest -m slow tests/sweep/test_zoo.py $(PYTEST_ARGS)
	$(PY) bench/peers/zoo_bench.py --zoo bench/zoo/hf.py:ALL --results build/zoo_bench.json

# the ecosystem zoo (issue 15): its slow test, then the torch.onnx-vs-onnxmedic table
bench-eco: $(STAMP)
	$(PY) -m pip install -q -e '.[zoo]'
	$(PY) -m pytest -m slow tests/sweep/test_ecosystem.py $(PYTEST_ARGS)
	$(PY) bench/peers/zoo_bench.py --zoo bench/zoo/ecosystem.py:ALL --results build/eco_bench.json

# optimum-cli, a peer of bench/peers/generation.py, in its own venv: optimum-onnx 0.1.0 pins
# transformers<4.58 (pip refuses it beside transformers 5.x); the same pinned torch
OVENV := build/venv-optimum
bench-optimum-venv:
	test -x $(OVENV)/bin/python || $(PYTHON) -m venv $(OVENV)
	$(OVENV)/bin/python -m pip install -q torch==2.13.0
	$(OVENV)/bin/python -m pip install -q 'optimum-onnx[onnxruntime]==0.1.0'

lint: $(STAMP)
	$(PY) -m ruff check src tests bench tools examples

clean:
	rm -rf build .pytest_cache
