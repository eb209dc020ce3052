"""FuriosaAI RNGD: its environment (.venv-rngd), graphs, compiler check, runtime and furiosa-smi."""
