"""URI to pyarrow filesystem, atomic publish with done markers, checkpoint manifests, retries."""
