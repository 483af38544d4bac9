// Command forkd-agent is the guest agent of forkd microVMs: see package
// guest.
package main

import (
	"os"

	"github.com/forkd/forkd/internal/guest"
)

func main() {
	os.Exit(guest.Main(os.Args[1:]))
}
