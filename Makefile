# Two commands on a fresh machine: `make demo` runs the built-in example, `make test` runs the
# linter, the test suite, the transformers-release lane, the SGLang and vLLM lanes (what CI runs). Each
# creates .venv on first use; the SGLang lane builds its own environment once
# (scripts/sglang_env.sh, cached under ~/.cache/hsstore), and so does the vLLM lane
# (scripts/vllm_env.sh). `make test-sglang` and `make test-vllm` run those lanes alone.
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed
DEMO_OUT := demo_out

# Run again on the portable decode path (numcodecs, xxhash; no compiled decoder or digests).
PORTABLE_TESTS := tests/test_codec_split_frames.py tests/test_batch_checksums.py \
	tests/test_store_roundtrip.py tests/test_tiers.py

.PHONY: demo test test-sglang test-vllm schemas

# Re-run the installer when the dependencies, the compiled module or the installer change.
$(INSTALLED): pyproject.toml setup.py hsstore/codec/_split_decoder.c hsstore/codec/byte_planes.h hsstore/spec/_xxh3_many.c hsstore/storage/_pread_many.c scripts/install.sh
	bash scripts/install.sh
	touch $@

demo: $(INSTALLED)
	rm -rf $(DEMO_OUT)
	$(BIN)/hsstore demo $(DEMO_OUT)

test: $(INSTALLED)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest --durations=20
	HSSTORE_NO_FAST_DECODE=1 $(BIN)/python -m pytest -q $(PORTABLE_TESTS)
	bash scripts/test_transformers_versions.sh
	bash scripts/test_sglang_lane.sh
	bash scripts/test_vllm_lane.sh

# The real sglang 0.5.23 engine on CPU, in its own cached environment (part of `test`).
test-sglang: $(INSTALLED)
	bash scripts/test_sglang_lane.sh

# The real vllm 0.32.0 engine on CPU, in its own cached environment (the last part of `test`).
test-vllm: $(INSTALLED)
	bash scripts/test_vllm_lane.sh

# The top-level schemas/ is the published copy and the one to edit; the code reads the copy
# inside the package (tests/test_packaging.py fails until this is run after an edit).
schemas:
	cp schemas/*.json hsstore/schemas/
