"""Engine replicas on Ray Serve behind the one front (`sluice serve --replicas N`).

router.py and stats.py are plain Python; front.py imports Ray only when it starts; launch.py and replica.py
import Ray and are loaded only with --replicas.
"""
