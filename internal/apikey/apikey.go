// Package apikey keeps the E2B-format API keys forkd issues: "e2b_" and 40
// lowercase hex digits, each standing for forkd's own token on the E2B
// listener (docs/e2b.md). Only a key's SHA-256 is stored, in one JSON file
// of mode 0600 written atomically; a presented key is checked against
// every stored hash in constant time.
package apikey

import (
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"regexp"
	"slices"
	"sync"
	"syscall"
	"time"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/fsutil"
)

// Prefix starts every key.
const Prefix = "e2b_"

// keyRE is the shape of a key.
var keyRE = regexp.MustCompile(`^e2b_[0-9a-f]{40}$`)

// Key is one issued key, without the key itself.
type Key struct {
	ID   string `json:"id"`
	Name string `json:"name,omitempty"`
	// Hint is the key's first 8 and last 4 characters, to tell keys apart.
	Hint    string    `json:"hint"`
	Created time.Time `json:"created"`
	Hash    string    `json:"sha256"` // hex SHA-256 of the key
}

// file is the store's file.
type file struct {
	Version int   `json:"version"`
	Keys    []Key `json:"keys"`
}

// Store is the key file at one path. Safe for concurrent use; the file is
// read again when another process changed it.
type Store struct {
	path string

	mu   sync.Mutex
	keys []Key  // guarded by mu
	seen fileID // guarded by mu; the file last read
}

// fileID tells versions of the file apart: each atomic write makes a new
// inode.
type fileID struct {
	ino  uint64
	mod  time.Time
	size int64
}

func idOf(st fs.FileInfo) fileID {
	id := fileID{mod: st.ModTime(), size: st.Size()}
	if sys, ok := st.Sys().(*syscall.Stat_t); ok {
		id.ino = sys.Ino
	}
	return id
}

// Open returns the store at path (a missing file holds no keys). A file
// that group or others can read is refused.
func Open(path string) (*Store, error) {
	s := &Store{path: path}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.loadLocked(); err != nil {
		return nil, err
	}
	return s, nil
}

// loadLocked reads the file when it changed since the last read.
func (s *Store) loadLocked() error {
	st, err := os.Stat(s.path)
	if errors.Is(err, fs.ErrNotExist) {
		s.keys, s.seen = nil, fileID{}
		return nil
	}
	if err != nil {
		return err
	}
	if id := idOf(st); id.ino == s.seen.ino && id.mod.Equal(s.seen.mod) && id.size == s.seen.size && s.keys != nil {
		return nil
	}
	if st.Mode().Perm()&0o077 != 0 {
		return errdefs.FailedPrecondition("API key file %s has mode %v: group and others must not read it (chmod 600)", s.path, st.Mode().Perm())
	}
	b, err := os.ReadFile(s.path)
	if err != nil {
		return err
	}
	var f file
	if err := json.Unmarshal(b, &f); err != nil {
		return fmt.Errorf("API key file %s: %w", s.path, err)
	}
	s.keys, s.seen = f.Keys, idOf(st)
	if s.keys == nil {
		s.keys = []Key{}
	}
	return nil
}

func (s *Store) saveLocked(keys []Key) error {
	if err := fsutil.WriteJSON(s.path, file{Version: 1, Keys: keys}, 0o600); err != nil {
		return err
	}
	s.keys, s.seen = keys, fileID{}
	if st, err := os.Stat(s.path); err == nil {
		s.seen = idOf(st)
	}
	return nil
}

// Create issues a new key named name and returns it: the only time the key
// itself is known.
func (s *Store) Create(name string) (string, Key, error) {
	if len(name) > 64 {
		return "", Key{}, errdefs.InvalidArgument("key name %s: at most 64 bytes", errdefs.Quote(name))
	}
	var secret [20]byte
	var id [6]byte
	if _, err := rand.Read(secret[:]); err != nil {
		return "", Key{}, err
	}
	if _, err := rand.Read(id[:]); err != nil {
		return "", Key{}, err
	}
	key := Prefix + hex.EncodeToString(secret[:])
	sum := sha256.Sum256([]byte(key))
	k := Key{ID: "key_" + hex.EncodeToString(id[:]), Name: name, Hint: key[:8] + "…" + key[len(key)-4:],
		Created: time.Now().UTC().Truncate(time.Second), Hash: hex.EncodeToString(sum[:])}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.loadLocked(); err != nil {
		return "", Key{}, err
	}
	if err := s.saveLocked(append(slices.Clone(s.keys), k)); err != nil {
		return "", Key{}, err
	}
	return key, k, nil
}

// List returns the keys, oldest first.
func (s *Store) List() ([]Key, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.loadLocked(); err != nil {
		return nil, err
	}
	return slices.Clone(s.keys), nil
}

// Revoke removes key id (ErrNotFound if there is none).
func (s *Store) Revoke(id string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.loadLocked(); err != nil {
		return err
	}
	i := slices.IndexFunc(s.keys, func(k Key) bool { return k.ID == id })
	if i < 0 {
		return errdefs.NotFound("API key %s not found", errdefs.Quote(id))
	}
	return s.saveLocked(slices.Delete(slices.Clone(s.keys), i, i+1))
}

// Check reports the key that presented matches. Every stored hash is
// compared, in constant time, whatever matches: the time taken says
// nothing about the keys.
func (s *Store) Check(presented string) (Key, bool) {
	s.mu.Lock()
	err := s.loadLocked()
	keys := s.keys
	s.mu.Unlock()
	if err != nil || !keyRE.MatchString(presented) {
		return Key{}, false
	}
	sum := sha256.Sum256([]byte(presented))
	var found Key
	ok := 0
	for _, k := range keys {
		want, err := hex.DecodeString(k.Hash)
		if err != nil || len(want) != len(sum) {
			continue
		}
		if subtle.ConstantTimeCompare(want, sum[:]) == 1 {
			found, ok = k, 1
		}
	}
	return found, ok == 1
}

// Valid reports whether s has the shape of a key.
func Valid(s string) bool { return keyRE.MatchString(s) }
