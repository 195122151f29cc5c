"""``forerun serve``'s command line: the missing extra, bad options and a
busy port are clean errors, before any model is loaded."""

import socket
import subprocess
import sys

from forerun.cli.main import main

# Run the CLI as if the server extra were not installed: a None entry in
# sys.modules makes the import (and importlib's lookup) fail.
WITHOUT_EXTRA = ("import sys\n"
                 "for m in ('uvicorn', 'starlette'): sys.modules[m] = None\n"
                 "from forerun.cli.main import main\n"
                 "sys.exit(main(['serve', '-m', 'smollm2-135m']))\n")


def test_without_the_extra_it_prints_the_install_command():
    proc = subprocess.run([sys.executable, "-c", WITHOUT_EXTRA], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1
    assert "pip install 'forerun[server]'" in proc.stderr
    assert "uvicorn" in proc.stderr and "starlette" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_options_are_clean_errors(capsys):
    for args, words in ((["--max-queue", "0"], "--max-queue"),
                        (["--port", "70000"], "--port"),
                        (["--prefix-cache-mb", "-1"], "--prefix-cache-mb"),
                        (["--api-key", " "], "--api-key")):
        assert main(["serve", "-m", "/nonexistent/model.gguf", *args]) == 1
        assert words in capsys.readouterr().err


def test_a_busy_port_is_a_clean_error(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "-m", "/nonexistent/model.gguf", "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "--port" in err


def test_a_missing_model_is_a_clean_error(capsys):
    assert main(["serve", "-m", "/nonexistent/model.gguf", "--port", "0"]) == 1
    assert "neither a preset nor an existing path" in capsys.readouterr().err
