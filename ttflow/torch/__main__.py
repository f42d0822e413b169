"""`python -m ttflow.torch`: build the device guard now (e.g. in a Docker image) and say where."""

from ._guard import load_guard

if __name__ == "__main__":
    print(f"ttflow.torch device guard: {load_guard()}")
