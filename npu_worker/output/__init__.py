"""The rank's output process (torch-free): detokenizing, stop strings, publishing."""
