"""The Python API (trainers and model loading for notebooks and scripts); the command
line sits on it. Reserved: nothing here yet."""
