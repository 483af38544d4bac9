package e2b

import "time"

// Wire types of E2B's control plane (its openapi.yml), JSON names as E2B
// spells them.

// newSandboxRequest is the body of POST /sandboxes and /v2/sandboxes.
type newSandboxRequest struct {
	TemplateID          string            `json:"templateID"`
	Timeout             *int              `json:"timeout,omitempty"` // seconds
	Metadata            map[string]string `json:"metadata,omitempty"`
	EnvVars             map[string]string `json:"envVars,omitempty"`
	AllowInternetAccess *bool             `json:"allow_internet_access,omitempty"`
	Network             *sandboxNetwork   `json:"network,omitempty"`
	AutoPause           *bool             `json:"autoPause,omitempty"`
	AutoPauseMemory     *bool             `json:"autoPauseMemory,omitempty"`
	AutoResume          *struct {
		Enabled bool `json:"enabled"`
	} `json:"autoResume,omitempty"`
	Secure       *bool          `json:"secure,omitempty"`
	MCP          map[string]any `json:"mcp,omitempty"`
	VolumeMounts []any          `json:"volumeMounts,omitempty"`
	IAM          map[string]any `json:"iam,omitempty"`
}

// sandboxNetwork is a sandbox's network settings; forkd honours
// allowPublicTraffic and, as a whole, denyOut ["0.0.0.0/0"].
type sandboxNetwork struct {
	AllowOut           []string       `json:"allowOut,omitempty"`
	DenyOut            []string       `json:"denyOut,omitempty"`
	Rules              map[string]any `json:"rules,omitempty"`
	EgressProxy        map[string]any `json:"egressProxy,omitempty"`
	AllowPublicTraffic *bool          `json:"allowPublicTraffic,omitempty"`
	MaskRequestHost    *string        `json:"maskRequestHost,omitempty"`
	HTTPSPorts         []int          `json:"httpsPorts,omitempty"`
}

// sandboxWire is E2B's Sandbox: what create, connect and fork answer.
type sandboxWire struct {
	SandboxID          string  `json:"sandboxID"`
	TemplateID         string  `json:"templateID"`
	Alias              string  `json:"alias,omitempty"`
	ClientID           string  `json:"clientID"`
	EnvdVersion        string  `json:"envdVersion"`
	EnvdAccessToken    string  `json:"envdAccessToken,omitempty"`
	TrafficAccessToken *string `json:"trafficAccessToken"`
	Domain             *string `json:"domain"`
}

// listedSandbox is E2B's ListedSandbox.
type listedSandbox struct {
	SandboxID   string            `json:"sandboxID"`
	TemplateID  string            `json:"templateID"`
	Alias       string            `json:"alias,omitempty"`
	ClientID    string            `json:"clientID"`
	StartedAt   time.Time         `json:"startedAt"`
	EndAt       time.Time         `json:"endAt"`
	State       string            `json:"state"`
	CPUCount    int               `json:"cpuCount"`
	MemoryMB    int               `json:"memoryMB"`
	DiskSizeMB  int               `json:"diskSizeMB"`
	EnvdVersion string            `json:"envdVersion"`
	Metadata    map[string]string `json:"metadata"`
}

// sandboxDetail is E2B's SandboxDetail (GET /sandboxes/{id}).
type sandboxDetail struct {
	listedSandbox
	EnvdAccessToken     string    `json:"envdAccessToken,omitempty"`
	Domain              *string   `json:"domain"`
	AllowInternetAccess *bool     `json:"allowInternetAccess"`
	Lifecycle           lifecycle `json:"lifecycle"`
}

type lifecycle struct {
	OnTimeout  string `json:"onTimeout"` // "kill" or "pause"
	AutoResume bool   `json:"autoResume"`
}

// timeoutRequest is the body of POST /sandboxes/{id}/timeout.
type timeoutRequest struct {
	Timeout int `json:"timeout"`
}

// connectRequest is the body of POST /v2/sandboxes/{id}/connect (and the
// legacy resume).
type connectRequest struct {
	Timeout *int  `json:"timeout,omitempty"`
	Memory  *bool `json:"memory,omitempty"`
}

// pauseRequest is the body of POST /sandboxes/{id}/pause.
type pauseRequest struct {
	Memory *bool `json:"memory,omitempty"`
}

// forkRequest is the body of POST /sandboxes/{id}/fork.
type forkRequest struct {
	Count   *int `json:"count,omitempty"`
	Timeout *int `json:"timeout,omitempty"`
}

// forkResult is one entry of a fork's answer.
type forkResult struct {
	Sandbox *sandboxWire `json:"sandbox,omitempty"`
	Error   *apiError    `json:"error,omitempty"`
}

// snapshotRequest is the body of POST /sandboxes/{id}/snapshots.
type snapshotRequest struct {
	Name string `json:"name,omitempty"`
}

// snapshotInfo answers it, and lists snapshots.
type snapshotInfo struct {
	SnapshotID string   `json:"snapshotID"`
	Names      []string `json:"names"`
}

// sandboxMetric is one sample of GET /sandboxes/{id}/metrics.
type sandboxMetric struct {
	Timestamp     time.Time `json:"timestamp"`
	TimestampUnix int64     `json:"timestampUnix"`
	CPUCount      int       `json:"cpuCount"`
	CPUUsedPct    float64   `json:"cpuUsedPct"`
	MemUsed       int64     `json:"memUsed"`
	MemTotal      int64     `json:"memTotal"`
	MemCache      int64     `json:"memCache"`
	DiskUsed      int64     `json:"diskUsed"`
	DiskTotal     int64     `json:"diskTotal"`
}

// networkUpdate is the body of PUT /sandboxes/{id}/network.
type networkUpdate struct {
	AllowOut            []string       `json:"allowOut,omitempty"`
	DenyOut             []string       `json:"denyOut,omitempty"`
	Rules               map[string]any `json:"rules,omitempty"`
	EgressProxy         map[string]any `json:"egressProxy,omitempty"`
	AllowInternetAccess *bool          `json:"allow_internet_access,omitempty"`
}
