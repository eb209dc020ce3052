"""The `shm` transport: same-host hand-off through pre-faulted slot files in /dev/shm."""
