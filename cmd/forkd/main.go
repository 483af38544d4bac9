// Command forkd runs microVM sandboxes forked from warm snapshots.
package main

import (
	"os"

	"github.com/forkd/forkd/internal/cli"
)

func main() {
	os.Exit(cli.Main(os.Args[1:]))
}
