"""What a process does to itself, shared by the API process and the device workers: how its
glibc heap keeps or returns freed memory (heap.py), and where its caches live (cache_dirs.py)."""
