"""Data parallelism: N engine replicas on one host behind one API process.

- `data_parallel.py`: DataParallelLLM, what the app serves (AsyncLLM's surface).
- `router.py`: which replica runs a request (the one holding its pages, else the least loaded).
- `handle.py`: a replica's process as the API process sees it.
- `replica.py`: the replica's process: an engine run by an EngineLoop fed through a pipe.
- `deltas.py`: what a replica sends of each step's outputs, and how they are put back together.
"""
