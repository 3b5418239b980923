#!/usr/bin/env bash
# WebShop's own interpreter and data, on a checkout of the WebShop repository
# (princeton-nlp/WebShop).
# The engine (`web_agent_site`) is not on a package index (the PyPI `webshop` package lists its
# dependencies but does not ship it), and its product data and search index are downloaded and
# built by the repository's own scripts, so this script needs that checkout and the network.
#
#   envs/setup/webshop.sh WEBSHOP_CHECKOUT [VENV (.venv-webshop)]
#
# then, for training / evaluation:
#   export COPE_ENV_PYTHON_WEBSHOP=<VENV>/bin/python WEBSHOP_ROOT=<WEBSHOP_CHECKOUT>
#
# Steps: a venv with WebShop's dependencies (pyserini needs a JDK: apt-get install
# default-jdk-headless), spaCy's small English model, the 1,000-product data (`setup.sh -d small`
# of the checkout) and its Lucene index (search_engine/indexes_1k). envs/webshop.py checks each of
# them at start and names what is missing.
set -euo pipefail
checkout="$(cd "${1:?usage: envs/setup/webshop.sh WEBSHOP_CHECKOUT [VENV]}" && pwd)"
cd "$(dirname "$0")/../.."
venv="${2:-.venv-webshop}"
if [ ! -d "$checkout/web_agent_site" ]; then
  echo "$checkout has no web_agent_site/: not a WebShop checkout" >&2
  exit 1
fi
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$(cd "$venv" && pwd)/bin/python"
"$py" -m pip install -q --upgrade pip
# WebShop's dependency list (torch, pyserini, spacy, gym, ...)
"$py" -m pip install -q "webshop==0.1.0"
"$py" -m spacy download en_core_web_sm || echo "install spaCy's en_core_web_sm model by hand" >&2
if [ ! -f "$checkout/data/items_shuffle_1000.json" ]; then
  (cd "$checkout" && PATH="$(dirname "$py"):$PATH" bash setup.sh -d small)
fi
if [ ! -d "$checkout/search_engine/indexes_1k" ]; then
  (cd "$checkout/search_engine" && mkdir -p resources_1k indexes_1k \
    && "$py" convert_product_file_format.py \
    && "$py" -m pyserini.index.lucene --collection JsonCollection --input resources_1k \
         --index indexes_1k --generator DefaultLuceneDocumentGenerator --threads 1 \
         --storePositions --storeDocvectors --storeRaw)
fi
echo "export COPE_ENV_PYTHON_WEBSHOP=$py WEBSHOP_ROOT=$checkout"
