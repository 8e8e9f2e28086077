"""What the example scripts share: reading the user's data files, checking the output folder before a run."""
