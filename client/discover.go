package client

import (
	"os"
	"path/filepath"
)

// DefaultSocket is where `forkd serve` listens by default:
// /run/forkd/forkd.sock as root, else $XDG_RUNTIME_DIR/forkd/forkd.sock
// ("" when that variable is unset).
func DefaultSocket() string {
	if os.Geteuid() == 0 {
		return "/run/forkd/forkd.sock"
	}
	if d := os.Getenv("XDG_RUNTIME_DIR"); d != "" {
		return filepath.Join(d, "forkd", "forkd.sock")
	}
	return ""
}

// DefaultAddr is the daemon's default TCP address.
const DefaultAddr = "127.0.0.1:8889"
