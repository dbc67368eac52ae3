"""Put this directory first on PYTHONPATH and its ``sitecustomize`` starts ``collectors.attach`` in every interpreter."""
