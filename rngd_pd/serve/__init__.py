"""Launching and supervising tritonserver (`rngd-pd serve`); never imported inside a stub."""
