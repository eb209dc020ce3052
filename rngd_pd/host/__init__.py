"""This host's processes: children that die with their parent, Triton stub processes found in /proc."""
