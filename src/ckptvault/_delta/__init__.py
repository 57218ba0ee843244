"""Incremental checkpoints: chunk deltas against a keyframe (docs/DESIGN.md §6).

``policy`` says when a save is a keyframe and keeps the keyframe a delta save compares against; ``bases`` finds,
for each new chunk, the keyframe chunk holding the same bytes of the same tensor; ``reads`` reads those base chunks
back, whole for a save and by range for a restore. The delta encoding itself is a codec: ``_codecs.xplanes``.
"""
