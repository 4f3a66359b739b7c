"""The rank's output process (torch-free): detokenizing, stop strings, publishing
(docs/architecture.md §9)."""
