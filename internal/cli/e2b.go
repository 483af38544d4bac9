package cli

import (
	"fmt"
	"time"

	"github.com/spf13/cobra"

	apiv1 "github.com/forkd/forkd/api/v1"
)

func newE2BCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "e2b key create|ls|revoke",
		Short: "E2B compatibility: API keys for the E2B listener (forkd serve --e2b-listen)",
		Long: `The E2B SDKs (npm e2b, @e2b/code-interpreter) run unchanged against forkd serve
--e2b-listen ADDR with E2B_API_KEY set to a key issued here, E2B_API_URL and
E2B_SANDBOX_URL (or E2B_DOMAIN) pointing at the listener. See docs/e2b.md.`,
	}
	key := &cobra.Command{Use: "key create|ls|revoke", Short: "Issue, list and revoke E2B API keys"}
	var name string
	var createJSON bool
	create := &cobra.Command{
		Use: "create [--name N]", Short: "Issue a key (printed once: the daemon keeps only its hash)", Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, done, err := g.api(cmd.Context())
			if err != nil {
				return err
			}
			defer done()
			k, err := c.CreateE2BKey(cmd.Context(), name)
			if err != nil {
				return err
			}
			if createJSON {
				return writeJSON(g.stdout, k)
			}
			fmt.Fprintln(g.stdout, k.Key)
			fmt.Fprintf(g.stderr, "forkd: key %s issued; it is shown only now (export E2B_API_KEY=...)\n", k.ID)
			return nil
		},
	}
	create.Flags().StringVar(&name, "name", "", "a name to tell the key by")
	create.Flags().BoolVar(&createJSON, "json", false, "print the key as JSON")
	var lsJSON bool
	ls := &cobra.Command{
		Use: "ls", Short: "List keys (without the keys)", Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, done, err := g.api(cmd.Context())
			if err != nil {
				return err
			}
			defer done()
			keys, err := c.ListE2BKeys(cmd.Context())
			if err != nil {
				return err
			}
			if keys == nil {
				keys = []apiv1.E2BKey{}
			}
			return printList(g, lsJSON, "keys", "ID\tNAME\tKEY\tCREATED", keys, func(k apiv1.E2BKey) string {
				return fmt.Sprintf("%s\t%s\t%s\t%s", k.ID, dash(k.Name), k.Hint, k.Created.Local().Format(time.DateTime))
			})
		},
	}
	ls.Flags().BoolVar(&lsJSON, "json", false, "print JSON")
	revoke := &cobra.Command{
		Use: "revoke ID...", Short: "Revoke keys", Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, ids []string) error {
			c, done, err := g.api(cmd.Context())
			if err != nil {
				return err
			}
			defer done()
			for _, id := range ids {
				if err := c.RevokeE2BKey(cmd.Context(), id); err != nil {
					return err
				}
				fmt.Fprintln(g.stdout, id)
			}
			return nil
		},
	}
	key.AddCommand(create, ls, revoke)
	cmd.AddCommand(key)
	return cmd
}
