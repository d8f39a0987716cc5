#!/bin/bash
# Build the ckptdrain Debian package with dpkg-deb: a self-contained environment in
# /opt/ckptdrain (a venv on the system python3 holding ckptdrain and the daemon's
# dependencies), /usr/bin/ckptdrain, the units in /lib/systemd/system, the config in
# /etc/ckptdrain, the docs in /usr/share/doc/ckptdrain, and a ckptdrain system user made by
# postinst. Usage: packaging/deb/build.sh OUT_DIR (run from the repository root; `make deb`).
set -euo pipefail
out=$(realpath -m "${1:-build}")
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
python=${DEB_PYTHON:-/usr/bin/python3}
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$repo/pyproject.toml" | head -1)
arch=$(dpkg --print-architecture)
work="$out/deb-work"
root="$work/root"
prefix=/opt/ckptdrain
rm -rf "$work"
mkdir -p "$root$prefix" "$work/src" "$out"

# The wheel, built from a copy so the tree stays clean.
cp -r "$repo/pyproject.toml" "$repo/README.md" "$repo/client" "$repo/daemon" "$work/src/"
find "$work/src" -name __pycache__ -prune -exec rm -rf {} +
"$python" -m venv "$root$prefix"
venv_python="$root$prefix/bin/python"
"$venv_python" -m pip --disable-pip-version-check -q install setuptools wheel
"$venv_python" -m pip --disable-pip-version-check -q wheel --no-deps --no-build-isolation \
    -w "$work/dist" "$work/src"
wheel=$(ls "$work"/dist/ckptdrain-*.whl)
# No .pyc at build time: they would name the build directory; postinst compiles in place.
"$venv_python" -m pip --disable-pip-version-check -q install --no-compile "${wheel}[daemon]"
"$venv_python" -m pip --disable-pip-version-check -q uninstall -y setuptools wheel pip
find "$root$prefix" -name __pycache__ -prune -exec rm -rf {} +
rm -f "$root$prefix"/bin/activate* "$root$prefix"/bin/Activate.ps1
# A venv names its own path; make it name where it is installed.
grep -rlI --null "$root$prefix" "$root$prefix/bin" "$root$prefix/pyvenv.cfg" 2>/dev/null \
    | xargs -0 -r sed -i "s#$root$prefix#$prefix#g"
! grep -rqI "$root" "$root$prefix/bin" "$root$prefix/pyvenv.cfg"

install -d "$root/usr/bin" "$root/lib/systemd/system" "$root/etc/ckptdrain" \
    "$root/usr/share/doc/ckptdrain" "$root/DEBIAN"
ln -s "$prefix/bin/ckptdrain" "$root/usr/bin/ckptdrain"
install -m 0644 "$repo"/systemd/ckptdrain.service "$repo"/systemd/ckptdrain.socket \
    "$root/lib/systemd/system/"
install -m 0644 "$repo/deploy/ckptdrain.example.toml" "$root/etc/ckptdrain/ckptdrain.toml"
install -m 0644 "$repo/README.md" "$repo"/docs/*.md "$root/usr/share/doc/ckptdrain/"
cp -r "$repo/deploy" "$root/usr/share/doc/ckptdrain/examples"

size_kib=$(du -sk --exclude=DEBIAN "$root" | cut -f1)
sed -e "s/@VERSION@/$version/" -e "s/@ARCH@/$arch/" -e "s/@SIZE@/$size_kib/" \
    "$here/control" > "$root/DEBIAN/control"
install -m 0644 "$here/conffiles" "$root/DEBIAN/conffiles"
install -m 0755 "$here/postinst" "$here/prerm" "$here/postrm" "$root/DEBIAN/"
deb="$out/ckptdrain_${version}_${arch}.deb"
dpkg-deb --root-owner-group -Zxz --build "$root" "$deb" >/dev/null
rm -rf "$work"
echo "$deb"
