"""Python-backend model files that tests and benches copy into a temporary model repository as
`<model>/1/model.py` (rngd_pd.testing.repository.write_model); tritonserver loads them from there."""

from pathlib import Path

HERE = Path(__file__).parent
ECHO = HERE / "echo_model.py"  # streams its input ids back (params, pbutils and metrics as the real models)
FAN = HERE / "fan_model.py"  # fans one request out into many concurrent streams to `echo`
