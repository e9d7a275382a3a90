from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

_Key = bytes | bytearray | memoryview | str

def murmur2(key: _Key) -> int: ...
def murmur2_many(keys: Iterable[_Key]) -> npt.NDArray[np.int32]: ...
def partition_many(keys: Iterable[_Key], num_partitions: int) -> npt.NDArray[np.int32]: ...
