pip install -e . && bucketwise demo
