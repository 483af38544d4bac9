package testutil

import (
	"crypto/sha256"
	"encoding/hex"
	"io"
	"os"
	"testing"
)

// FileSHA256 returns the hex sha256 of the file at path, failing t if it
// cannot be read.
func FileSHA256(t testing.TB, path string) string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(h.Sum(nil))
}
