#!/usr/bin/env sh
# Install PagedDesk for the current user: a virtual environment, the package, and a desktop entry.
# Usage: installer/install.sh [VENV_DIR]   (default: ~/.local/share/PagedDesk/venv)
set -eu

REPO_DIR=$(cd "$(dirname "$0")/.." && pwd)
DATA_DIR=${XDG_DATA_HOME:-"$HOME/.local/share"}
VENV_DIR=${1:-"$DATA_DIR/PagedDesk/venv"}
PYTHON=${PYTHON:-python3}

"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
    echo "PagedDesk needs Python 3.11 or newer; set PYTHON=/path/to/python3.11" >&2; exit 1; }

echo "Creating virtual environment in $VENV_DIR"
"$PYTHON" -m venv "$VENV_DIR"
"$VENV_DIR/bin/python" -m pip install --upgrade pip
"$VENV_DIR/bin/python" -m pip install "$REPO_DIR"

ICON_DIR="$DATA_DIR/icons/hicolor/scalable/apps"
APP_DIR="$DATA_DIR/applications"
mkdir -p "$ICON_DIR" "$APP_DIR"
cp "$REPO_DIR/resources/pagedesk.svg" "$ICON_DIR/pagedesk.svg"
sed -e "s|@EXEC@|$VENV_DIR/bin/pagedesk|" -e "s|@ICON@|pagedesk|" \
    "$REPO_DIR/resources/pagedesk.desktop" > "$APP_DIR/pagedesk.desktop"
command -v update-desktop-database >/dev/null 2>&1 && update-desktop-database "$APP_DIR" || true

echo "Installed. Start it from your applications menu or run: $VENV_DIR/bin/pagedesk"
