"""The API: open a checkpoint (:mod:`.opening`), the handle it returns (:mod:`.handle`) with its iterators
(:mod:`.reads`) and slices (:mod:`.slices`), and the one-call entry points built on it (:mod:`.calls`)."""
